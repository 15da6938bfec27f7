"""What every layer shares and no API spells: actor messages, typed errors,
the vocabulary description. Imports nothing of ours."""
