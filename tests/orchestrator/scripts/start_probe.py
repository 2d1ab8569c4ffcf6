"""What a job sees of how it was started (for the warm/cold contract test): prints one JSON line, writes a word
to stderr, and exits with the code given on its command line (75 on its first attempt when asked to)."""

import json
import os
import signal
import sys
import threading

import __main__

env = os.environ
proc_env = dict(line.split("=", 1) for line in open("/proc/self/environ").read().split("\0") if "=" in line)
report = {
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
    "main_file": getattr(__main__, "__file__", None), "spec": __spec__.name if __spec__ else None,
    "own_session": os.getsid(0) == os.getppid() and os.getpgid(0) == os.getsid(0),
    "parent_leads": os.getsid(0) == os.getppid(),
    "cgroup": [line for line in open("/proc/self/cgroup").read().splitlines() if line.startswith("0::")],
    "contract": {k: env.get(k) for k in ("AUTORESEARCH_JOB_ID", "AUTORESEARCH_ATTEMPT", "AUTORESEARCH_CHECKPOINT_DIR",
                                         "AUTORESEARCH_PARAMS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "FOO")},
    "proc_environ_matches": proc_env == dict(env),
    "wrapper_vars": [k for k in env if k in ("AUTORESEARCH_EXIT_FILE", "AUTORESEARCH_CGROUP")],
    "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE,
                                                            signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1)},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "threads": threading.active_count(),
    "stdin": os.readlink("/proc/self/fd/0"),
}
print(json.dumps(report), flush=True)
print("probe-stderr", file=sys.stderr, flush=True)
code = int(sys.argv[1])
sys.exit(75 if code == 75 and env.get("AUTORESEARCH_ATTEMPT") == "1" else 0 if code == 75 else code)
