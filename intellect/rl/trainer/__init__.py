"""The trainer's process: the RL run and the phases of a step, the GRPO trainer, checkpoint
publication, held-out evaluation, the run's own worker processes and the offline difficulty filter."""
