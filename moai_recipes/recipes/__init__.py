"""The recipes, one file each, read top to bottom: compose -> flavor -> plan -> build -> train loop -> save."""
