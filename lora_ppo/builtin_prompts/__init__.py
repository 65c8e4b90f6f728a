"""Prompt sets shipped with lora_ppo (text files, one prompt a line)."""
