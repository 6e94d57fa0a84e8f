"""Drop-ins for trainers: ``rlfuse.integrations.verl`` (policy losses registered in verl),
``rlfuse.integrations.trl`` (a GRPOTrainer whose loss is rlfuse's) and
``rlfuse.integrations.megatron`` (Megatron-core's output layer). Optional imports: none of them
is a dependency of rlfuse.

``trl/`` and ``verl/`` hold each trainer's modules; ``model_heads`` what both read from a
``transformers`` model (its head, its router loss); ``verl_gr_opd`` the entry point of
``python -m rlfuse.integrations.verl_gr_opd`` (GR-OPD's runner in verl)."""
