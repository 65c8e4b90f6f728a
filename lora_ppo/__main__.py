"""`python -m lora_ppo ...` is `lora-ppo ...`; what `accelerate launch -m lora_ppo train RECIPE` starts."""

from lora_ppo.cli import app

app(prog_name="lora-ppo")
