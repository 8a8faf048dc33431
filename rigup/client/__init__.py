"""How the control machine talks to a rig: SSH and the OpenAI-compatible API."""
