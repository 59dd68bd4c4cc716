"""The wire formats: headers, field validators, the session API, AWS's and OpenAI's dialects."""
