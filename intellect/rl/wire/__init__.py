"""What the roles of an RL run exchange: the rollout schema and its files, prompt assignment and seeds, the
lag rule, the registration proof of work. Imported by the worker, the service and the trainer alike."""
