"""Model: decoder definition, config parsing and weight loading."""
