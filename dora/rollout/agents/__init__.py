"""Agent episodes: a user's agent, written against the OpenAI API, drives each sample through an endpoint of its worker."""
