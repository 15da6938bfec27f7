"""Model runners behind one small interface, and what loads a model."""
