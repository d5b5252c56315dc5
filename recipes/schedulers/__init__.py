"""Recipes for the schedulers users run on: Slurm (``slurm.sbatch``), Kubernetes (``kubernetes-job.yaml``,
``kubernetes-jobset.yaml``), SkyPilot (``skypilot.yaml``) and Ray Train (:mod:`.ray_train`). docs/launching.md has
the table of exit codes and each scheduler's retry rule."""
