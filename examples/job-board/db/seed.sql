CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT NOT NULL, budget INTEGER NOT NULL, status TEXT NOT NULL);
CREATE TABLE proposals (id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES jobs(id), status TEXT NOT NULL, text TEXT);
INSERT INTO jobs VALUES
  (41, 'Scrape a product catalog', 300, 'taken'),
  (42, 'Build a Flask dashboard', 500, 'open'),
  (43, 'Fix a Django migration', 250, 'open');
INSERT INTO proposals VALUES (7, 41, 'submitted', 'Hi, I can scrape the catalog into CSV within two days.');
