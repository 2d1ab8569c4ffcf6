"""Core: what every layer may use and that imports nothing above it: settings (`config`), where a home's files live
(`layout`), the error types (`errors`), durations, device specs and wake-up sockets."""
