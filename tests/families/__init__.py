"""Model families defined by tests, registered only in the processes that import them."""
