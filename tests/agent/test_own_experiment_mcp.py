"""MCP with a config-file experiment: `submit_job` and the experiment resource by path, then by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.faces.test_mcp import call, with_client
from tests.support.own import BOWL_TOML, folder

ROOT = Path(__file__).resolve().parents[2]


def test_an_outside_agent_submits_a_config_file_experiment_and_reads_its_space(home, tmp_path):
    root = folder(tmp_path, BOWL_TOML.format(name="mcpbowl"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTORESEARCH_")}
    env.update(AUTORESEARCH_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
               PYTHONPATH=str(ROOT), AUTORESEARCH_PREFLIGHT="off")

    async def body(session):
        ok = await call(session, "submit_job", experiment=str(root), params={"lr": 0.01, "act": "gelu"})
        bad = await call(session, "submit_job", experiment=str(root), params={"width": 1000})
        missing = await call(session, "submit_job", experiment=str(tmp_path / "nope"))
        space = await session.read_resource("autoresearch://experiments/mcpbowl")
        return ok, bad, missing, json.loads(space.contents[0].text)

    ok, bad, missing, space = with_client(env, body)
    assert not ok[0] and ok[1]["experiment"] == "mcpbowl" and ok[1]["params"]["lr"] == 0.01
    assert ok[1]["cwd"] == str(root.resolve())
    assert bad[0] and "parameter 'width'" in bad[1] and "\n" not in bad[1]
    assert missing[0] and "no such file or folder" in missing[1]
    assert space["experiment"] == "mcpbowl" and {p["name"] for p in space["space"]} == {"lr", "width", "act"}
    assert space["fixed"] == {"steps": 3}
