"""How much of the model's learning does a pipeline-link codec cost per byte it saves?"""
