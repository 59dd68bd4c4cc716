"""A chat page over the session API: try an endpoint in the browser before writing code.

`conversation.py` holds one tab's conversation over the kit's own client (no Gradio);
`app.py` lays the page out with Gradio (the `ui` extra). The server never imports either.
"""
