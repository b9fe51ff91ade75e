"""Framework-free vocabulary and plumbing (the floor every other room stands on): aliases, records, schema,
targets, safe file I/O, output threads, process groups, the fail-safe guard. Imports nothing above it."""
