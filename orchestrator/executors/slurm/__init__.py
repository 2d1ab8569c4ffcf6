"""The Slurm executor: each attempt one Slurm job (`executor`), through sbatch, squeue, scontrol and scancel (`jobs`)."""
