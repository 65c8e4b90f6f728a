"""Multi-turn agent training: the tools a model may call, its environment and its episodes."""
