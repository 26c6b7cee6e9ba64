"""The ASGI plumbing under the routes and the pipeline: the server's HTTP protocol (a header
deadline, and each request's response cycle lent for a stream's direct writes), reading a
request's body and watching for the client leaving, sending an answer or an error, and the
graceful drain. Nothing here knows a route or a stage."""
