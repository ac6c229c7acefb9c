"""Agent episodes: a user's agent, written against the OpenAI API, drives each sample through its worker's
endpoint."""
