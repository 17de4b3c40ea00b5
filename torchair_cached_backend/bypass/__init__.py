"""Guard-bypass loader: replay Dynamo's saved transformed bytecode in a fresh process."""
