"""What a caller asks for: app specs resolved against their data, and the use cases (register,
preview, apply, change a budget) that the API, the command line, the demo and the loops share."""
