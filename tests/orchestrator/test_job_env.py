"""What a job's process really sees: it dumps its own environment, and the agent's LLM key is not in it.

The service needs OPENAI_API_KEY for the agent's proposer, and a job inherits the service's environment
(the job protocol); the executor must drop the key on the way. Scanning files under the home would not notice a
job that could read the key but did not write it anywhere, so the job itself reports what it got.
"""

from __future__ import annotations

import json
import sys

from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import wait_for

KEY = "sk-test-job-env-7d21e9"
DUMP = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"


def run_and_dump(service, out, **spec) -> dict:
    """Run a job that writes its environment to `out`; return that environment."""
    job_id = api.submit(JobSpec(argv=[sys.executable, "-c", DUMP, str(out)], track=False, **spec))[0].id
    wait_for(lambda: service.store.get(job_id).state in ("SUCCEEDED", "FAILED"), timeout=60, what="the job")
    assert service.store.get(job_id).state == "SUCCEEDED"
    return json.loads(out.read_text())


def test_a_job_does_not_inherit_the_llm_api_key(make_service, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("SERVICE_ENV_MARKER", "inherited")
    service = make_service("cpu:1")
    env = run_and_dump(service, tmp_path / "env.json")
    # The dump is the job's real environment: the rest of the service's env and the protocol are there.
    assert env["SERVICE_ENV_MARKER"] == "inherited" and env["AUTORESEARCH_ATTEMPT"] == "1"
    assert "OPENAI_API_KEY" not in env
    assert not [name for name, value in env.items() if KEY in value], "the key hides under another name"
