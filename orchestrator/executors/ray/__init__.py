"""The Ray executor: each attempt a Ray job (`executor`), with Ray job ids and exit codes (`jobs`) and their logs
mirrored (`logs`)."""
