"""Drop-ins for trainers: ``rlfuse.integrations.verl`` (policy losses registered in verl),
``rlfuse.integrations.trl`` (a GRPOTrainer whose loss is rlfuse's) and
``rlfuse.integrations.megatron`` (Megatron-core's output layer). Optional imports: none of them
is a dependency of rlfuse."""
