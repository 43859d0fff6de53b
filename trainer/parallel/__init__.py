"""How ranks split and talk: topology, process groups, FSDP2, context parallel, memory estimate."""
