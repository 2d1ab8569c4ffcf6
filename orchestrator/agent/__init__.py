"""The research agent: a LangGraph loop that proposes trials, runs them through the queue, stops losers early
(ASHA), re-runs the best on fresh seeds and ranks the results. Entry points: `orchestrator.agent.runner`."""
