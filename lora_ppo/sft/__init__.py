"""`lora-ppo train-sft`: a policy LoRA adapter trained with the supervised loss on demonstrations, on
the 4-bit backbone PPO then starts from (`rows`: data to tokens and loss targets; `batches`: padded
or packed model input; `model`: the adapter and its masked cross-entropy; `samples`: held-out
completions; `trainer`: the run)."""
