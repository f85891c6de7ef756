"""`dflash-train synthesize`: the target writes its own prompts (Magpie-style), filtered and deduplicated.

Modules: `config` (the `synthesize` section), `template` (the user-turn prefix, found from the chat template),
`filters` (drop reasons, exact and near-duplicate detection), `writers` (the local and OpenAI-compatible
backends of `regen/`, asked for user turns and answers), `store` (the output directory: regenerate's shards),
`runner` (the loop). No imports here: the root config imports `synth.config` alone.
"""
