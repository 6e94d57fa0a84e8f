"""Drop-ins for trainers: ``rlfuse.integrations.verl`` (policy losses registered in verl) and
``rlfuse.integrations.trl`` (a GRPOTrainer whose loss is rlfuse's). Optional imports: neither
trainer is a dependency of rlfuse."""
