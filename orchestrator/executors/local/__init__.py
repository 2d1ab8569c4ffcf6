"""The local executor: attempts as process trees on this host, started by spawner processes (`spawner`), watched for
exits (`watch`), measured through psutil and cgroups (`procs`)."""
