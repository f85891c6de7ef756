"""Self-made prompts (dflash-train synthesize): their diversity against a reference set."""
