"""The queue: jobs and their states in SQL (SQLite, or PostgreSQL shared by several hosts). `states` and `models`
say what a job is and the rules it decides itself; `store` is the `JobStore`, made of parts that share one `db`:
`transitions`, the only code that changes a job's state (one transaction per transition, every one an event row),
`queries` and `listing`, which read, and the hosts', runs' and retention records (`inventory`, `runs`,
`keeping`); `policy` is the scheduler, a pure function from the line, the running jobs, the devices and the
projects to a plan (`backfill`, `projects`, `fairshare` and `usage` feed it). Imports only `core` of the
orchestrator."""
