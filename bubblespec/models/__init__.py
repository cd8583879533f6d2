"""The built-in decoder model (Llama, Qwen2/3, Mistral), which both the torch engine and the trainer run; it
imports only the bottom layer (docs/design.md §7)."""
