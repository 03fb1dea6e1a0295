"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline.

    protocol.py         the request body and its input items
    items.py            input items -> chat messages, the chat request a response runs as
    response_output.py  chat output -> response output items, whole or as streamed events
    response_run.py     one request's run: the response object, the event stream, the record
    response_store.py   stored responses and background event streams (JetStream)
    resume.py           resuming a background response whose gateway stopped
"""
