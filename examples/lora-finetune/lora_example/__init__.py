"""lora_example: federated LoRA fine-tuning with the pack's strategies."""
