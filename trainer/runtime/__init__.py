"""What surrounds a run: lock, preemption, health gate, tracking, environment, allocator, files."""
