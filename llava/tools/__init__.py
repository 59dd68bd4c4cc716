"""Developer tools the serving image does not need: tiny models, archive, deploy, chat page."""
