"""The Hugging Face Hub: pushing a run's pipeline and its model card, keeping secrets off disk."""
