"""The request path that the gateway and the batch runner both stand on.

OpenAI request models and their handlers (chat, completions), validation into sampling
parameters, engine choice, and the mesh client that submits a request, follows its output
back and moves it when its engine or tokenizer is lost. The gateway serves these handlers
over HTTP; the batch runner calls them in process for each batch line. Neither service
imports the other: both import this package.
"""
