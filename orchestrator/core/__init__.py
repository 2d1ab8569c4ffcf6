"""Core: what every layer may use and that imports nothing above it: settings (`config`), where a home's files live
(`layout`), the error types (`errors`), durations, device specs, wake-up sockets and the base of records stored
as plain dicts (`records`)."""
