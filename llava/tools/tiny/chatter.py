"""What chat clients send without a picture, and the one true reply the default model gives.

Chat clients open with text (a greeting, "what can you do?") and send requests of their own
(Open WebUI asks for a title and tags for every chat). The model knows only pictures of shapes,
so to any text without a picture it says so, in one short sentence, instead of describing a
picture it was never given.
"""

from __future__ import annotations

import random

from llava.tools.tiny.scenes import Turn, dialogue, draw_scene

REPLY = "Send me a picture of shapes, and I will tell you their colours, kinds, number and places."

GREETINGS = (
    "hi",
    "Hi!",
    "hello",
    "Hello!",
    "Hello there.",
    "hey",
    "Hey, how are you?",
    "Good morning!",
    "What can you do?",
    "What can you do for me?",
    "Who are you?",
    "What are you?",
    "Help",
    "How does this work?",
    "Are you there?",
    "Thanks!",
    "Thank you.",
    "Tell me a joke.",
    "What is the capital of France?",
    "Write a poem about the sea.",
    "Why is the sky blue?",
    "What is a triangle?",
    "Draw me a red circle.",
    "Summarize this conversation.",
    "Translate hello into French.",
    "What is 2 + 2?",
    "Can you help me with my homework?",
    "Describe a sunset.",
    "Can you see the picture?",
    "What colour is the circle?",
    "How many shapes are there?",
    "test",
)

# Open WebUI's own requests (title, tags, follow-ups), in the shape its default templates take.
TITLE = """### Task:
Generate a concise, 3-5 word title with an emoji summarizing the chat history.
### Guidelines:
- The title should clearly represent the main theme or subject of the conversation.
- Use emojis that enhance understanding of the topic, but avoid quotation marks or special \
formatting.
- Write the title in the chat's primary language; default to English if multilingual.
- Prioritize accuracy over excessive creativity; keep it clear and simple.
### Output:
JSON format: { "title": "your concise title here" }
### Chat History:
<chat_history>
USER: {question}
</chat_history>"""
TAGS = """### Task:
Generate 1-3 broad tags categorizing the main themes of the chat history, along with 1-3 more \
specific subtopic tags.
### Guidelines:
- Start with high-level domains (e.g. Science, Technology, Philosophy, Arts, Politics, Business)
- Consider including relevant subfields/subdomains if they are strongly represented
- If content is too short (less than 3 messages) or too diverse, use only ["General"]
- Use the chat's primary language; default to English if multilingual
### Output:
JSON format: { "tags": ["tag1", "tag2", "tag3"] }
### Chat History:
<chat_history>
USER: {question}
</chat_history>"""
FOLLOW_UPS = """### Task:
Suggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next in \
this conversation as a **user**, based on the chat history, to help continue or deepen the \
discussion.
### Output:
JSON format: { "follow_ups": ["Question 1?", "Question 2?", "Question 3?"] }
### Chat History:
<chat_history>
USER: {question}
</chat_history>"""
TASKS = (TITLE, TAGS, FOLLOW_UPS)


def text_prompt(rng: random.Random) -> str:
    """Return one message a chat client may send without a picture: a greeting or any other
    text, a client's own request, or a question about a picture that is not there (the words
    are the ones it answers with a picture: the picture's absence alone decides)."""
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(TASKS).replace("{question}", rng.choice(GREETINGS))
    if roll < 0.6:
        return dialogue(draw_scene(rng), rng, 1)[0].question
    return rng.choice(GREETINGS)


def text_dialogue(rng: random.Random, turns: int) -> list[Turn]:
    """Return ``turns`` text-only turns, each answered with the reply."""
    return [Turn(text_prompt(rng), REPLY, "no-picture") for _ in range(turns)]


def corpus() -> str:
    """Return every text this module sends, for the tokenizer to learn its words."""
    return "\n".join([REPLY, *GREETINGS, *TASKS])
