"""Git plumbing for program sessions: a session branch, one commit per trial, one worktree per running trial.

Nothing here touches the user's branch, index or working tree. Commits are made with a private index file
(`GIT_INDEX_FILE`) and `git commit-tree`; every trial commit gets its own ref `refs/autoresearch/SESSION/N`, so
discarded and failed variants stay reachable (nothing is ever reset away), and the branch
`autoresearch/SESSION` points at the session's incumbent (the best kept commit). Worktrees live under the
home (`programs/SESSION/N`) and are removed when their run ends; their commits stay.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

from orchestrator.core.errors import OrchestratorError

AUTHOR = {"GIT_AUTHOR_NAME": "autoresearch", "GIT_AUTHOR_EMAIL": "autoresearch@localhost",
          "GIT_COMMITTER_NAME": "autoresearch", "GIT_COMMITTER_EMAIL": "autoresearch@localhost"}


class GitError(OrchestratorError):
    """A git command failed."""


class Repo:
    """One program repository, seen through git commands (never its working tree)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def git(self, *args: str, input: str | None = None, env: Mapping[str, str] | None = None,
            check: bool = True) -> str:
        """Run `git ARGS` in the repository; its stdout (GitError with git's message on failure)."""
        full_env = {**os.environ, **AUTHOR, **(env or {})}
        out = subprocess.run(["git", *args], cwd=self.path, capture_output=True, text=True, input=input,
                             env=full_env)
        if check and out.returncode != 0:
            raise GitError(f"git {' '.join(args[:3])}: {out.stderr.strip()[-300:]}")
        return out.stdout

    # -- reading ---------------------------------------------------------------------------------------------------

    def resolve(self, rev: str) -> str | None:
        """The full commit id of `rev`, or None when it names no commit."""
        out = self.git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False).strip()
        return out or None

    def head(self) -> str:
        """The commit checked out in the user's working tree."""
        sha = self.resolve("HEAD")
        if sha is None:
            raise GitError(f"{self.path} has no commit yet: commit the program first")
        return sha

    def show(self, commit: str, path: str) -> str | None:
        """A file's text at `commit` (None when it does not exist there)."""
        out = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=self.path, capture_output=True)
        if out.returncode != 0:
            return None
        return out.stdout.decode("utf-8", errors="replace")

    def dirty(self, paths: list[str]) -> list[str]:
        """Which of `paths` differ in the user's working tree from HEAD (those changes are not in trials)."""
        out = self.git("status", "--porcelain", "--", *paths)
        return [line[3:] for line in out.splitlines() if line.strip()]

    def diff(self, parent: str, commit: str) -> str:
        """The patch from `parent` to `commit`."""
        return self.git("diff", parent, commit)

    # -- writing ---------------------------------------------------------------------------------------------------

    def commit(self, parent: str, files: Mapping[str, str], message: str) -> str:
        """A new commit: `parent` with `files` (repository paths -> text) replaced; the user's index is untouched."""
        with tempfile.TemporaryDirectory(prefix="autoresearch-index-") as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            self.git("read-tree", parent, env=env)
            for path, text in files.items():
                blob = self.git("hash-object", "-w", "--stdin", "--path", path, input=text).strip()
                mode = self.git("ls-tree", parent, "--", path).split(" ")[0] or "100644"
                self.git("update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}", env=env)
            tree = self.git("write-tree", env=env).strip()
        return self.git("commit-tree", tree, "-p", parent, input=message).strip()

    def set_ref(self, ref: str, commit: str) -> None:
        """Point `ref` at `commit` (created if missing)."""
        self.git("update-ref", ref, commit)

    def trial_ref(self, session: str, n: int) -> str:
        return f"refs/autoresearch/{session}/{n}"

    def branch(self, session: str) -> str:
        return f"refs/heads/autoresearch/{session}"

    # -- worktrees -------------------------------------------------------------------------------------------------

    def add_worktree(self, path: Path, commit: str) -> Path:
        """A detached worktree of `commit` at `path` (reused when a resumed session finds it already there)."""
        path = Path(path)
        if (path / ".git").exists():
            current = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
            if current.returncode == 0 and current.stdout.strip() == commit:
                return path
            self.remove_worktree(path)
        elif path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.git("worktree", "add", "--detach", "--force", str(path), commit)
        return path

    def remove_worktree(self, path: Path) -> None:
        """Remove a trial's worktree (its commit stays)."""
        path = Path(path)
        if path.exists():
            for p in path.rglob("*"):  # protected files were made read-only; rmtree needs them writable
                try:
                    if not p.is_symlink():
                        p.chmod(p.stat().st_mode | stat.S_IWUSR)
                except OSError:
                    pass
        self.git("worktree", "remove", "--force", str(path), check=False)
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            self.git("worktree", "prune", check=False)

    def restore_protected(self, worktree: Path, root_commit: str, paths: list[str]) -> None:
        """Write each protected file as it is at the session's root commit, read-only."""
        for path in paths:
            text = subprocess.run(["git", "show", f"{root_commit}:{path}"], cwd=self.path, capture_output=True,
                                  check=True).stdout
            target = worktree / path
            if target.exists():
                target.chmod(0o644)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text)
            target.chmod(0o444)
