"""After training: loading a run for inference, chat, generation, and held-out evaluation."""
