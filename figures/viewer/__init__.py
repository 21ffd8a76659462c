"""The trace viewer's workings: its data model (`views`), the label layers it declares (`layers`), the reader of a
study directory (`study`) and the page (`page`, with its script and style). `figures.trace` is its library face and
command line."""
