"""Tracking: everything that talks to MLflow. The client and the leaderboard (`client`), what a job's run is made of
(`jobruns`), runs made ahead of time (`preparer`) by a child process (`worker`)."""
