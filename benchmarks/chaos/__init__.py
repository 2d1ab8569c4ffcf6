"""The chaos soak's parts (`benchmarks/chaos_soak.py` runs them): its own PostgreSQL cluster (`cluster`), the work
and the processes that do it (`workload`, `handjob`), the faults (`faults`) and what must hold after them
(`invariants`)."""
