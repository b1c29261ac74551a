//! Models written with the megatron-rs DSL, registered by name.
