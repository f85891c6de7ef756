"""The peer bake-off: ModelOpt's and SpecForge's DFlash trainers against ours on the same target, data and budget."""
