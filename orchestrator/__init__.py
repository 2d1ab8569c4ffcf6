"""The service side of autoresearch: queue, scheduling policy, executors, service loop, agent, tracking, CLI."""
