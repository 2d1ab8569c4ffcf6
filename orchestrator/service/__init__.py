"""The service: the daemon that places queued jobs (`daemon`), settles exits and stops (`supervisor`), reaps lost hosts
(`reaper`), checks devices (`health`, `guard`) and holds its home (`homelock`)."""
