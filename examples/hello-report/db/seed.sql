CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount REAL NOT NULL, status TEXT NOT NULL);
INSERT INTO orders VALUES (1, 'acme', 120.0, 'open'), (2, 'globex', 75.5, 'open'), (3, 'initech', 300.0, 'shipped');
