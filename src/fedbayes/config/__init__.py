"""The run configuration: the schema (validated against the algorithm registry) and its reference."""
